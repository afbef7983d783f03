local t = {}
for i = 1, 300000 do t[i] = { i } end
return { keep = t }

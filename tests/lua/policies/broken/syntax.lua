-- syntax.lua: a syntax error on line 3.
return {
  x = = 1,
}

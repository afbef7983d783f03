-- An error dressed as the library's blames the policy all the same.
return { parallelize = function()
  error("moonshard: config examples/configs/llama3.1_8b.json: num_hidden_layers is not an integer", 0)
end }

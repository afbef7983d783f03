-- moonshard.models.gemma3: Gemma3ForCausalLM, Gemma 3's text model (transformers
-- models/gemma3/modeling_gemma3.py); the builder is moonshard.models.gemma's, shared with Gemma 2.
return require("moonshard.models.gemma")(3)

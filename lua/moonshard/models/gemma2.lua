-- moonshard.models.gemma2: Gemma2ForCausalLM (transformers models/gemma2/modeling_gemma2.py);
-- the builder is moonshard.models.gemma's, shared with Gemma 3.
return require("moonshard.models.gemma")(2)

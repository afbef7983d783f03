-- no_reshard.lua: Automodel's default parallelizer (policies/fsdp2_default.lua) with every
-- layer kept gathered after forward and every other layer activation-checkpointed: a
-- derived policy, one line, no copy of the shipped files.  `moonshard plan --set` still
-- applies on top (--set activation_checkpointing=false); `--list-options` shows the new
-- defaults.
return require("fsdp2_default").with{ reshard_after_forward = false, activation_checkpointing = "every:2" }

"""Files users copy or the tool renders: job YAMLs, env presets, repro scripts, the GRPO example."""

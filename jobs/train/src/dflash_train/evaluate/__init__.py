"""`dflash-train evaluate`: its config, the prompts it decodes, the offline speculative loop and the stage."""

"""Generate stage of dflash-pipeline: answer prompt records with the target model through vLLM."""

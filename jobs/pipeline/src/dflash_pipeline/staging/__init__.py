"""`stage-model`: a target model's folder into the object store (`stage_model`), checked first (`model_dir`),
committed by its listing (`model_listing`)."""

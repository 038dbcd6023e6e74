"""`pipeline plan`: what a run will take before it is submitted (`run_plan`), whether each GPU stage fits its GPU
(`fit`, `fit_engine`, `gpu_models`), the record lengths it assumes (`tokens`) and how long a lost rank holds a
gang's GPUs (`gang_hold`). Reads the `run` definition and the rendered objects, never a cluster."""

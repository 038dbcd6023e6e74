"""A submitted run on the cluster: the run driver that creates each stage's Job once its input is committed
(`driver`, through `kube`, writing `run_state`), and the commands a person runs beside it: `status` (with
`progress_view`), `wait`, `logs` (`run_logs`), `cancel`, `resume`, `restart`."""

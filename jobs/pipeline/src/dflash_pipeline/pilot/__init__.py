"""A run's pilot: the full run at full shape with its counts reduced (`derive`), its verdict from what it measured
(`report`), and the full run's plan again from the pilot's figures (`replan`)."""

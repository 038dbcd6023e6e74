"""Distribution: process groups, data-parallel and sharded wrapping, and how a rank's failure ends its gang."""

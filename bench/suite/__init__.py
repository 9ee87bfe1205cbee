"""The benchmark suite behind `make bench`: profiles, targets, workloads, report."""

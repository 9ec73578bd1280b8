"""Running stalwart on one machine: the demo task, worker processes, the chaos cluster and its report."""

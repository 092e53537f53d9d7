"""The serving benchmark (``pagedserve bench serve``): workload, client, statistics, report."""

"""Starting roles as processes: the local cluster and the shared-pool harness."""

"""The front router: probes replicas, picks the one that will answer first, forwards."""

"""Load-test harness and cluster simulator."""

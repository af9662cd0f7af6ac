"""Capacity planning: the three schemes simulated on a virtual clock (the real schedulers, measured step
costs), validated against a load test's measurements, and replicas planned for a rate within an SLO.
Load testing measures one machine (loadtest/); this predicts many."""

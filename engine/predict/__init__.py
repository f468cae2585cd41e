"""Predictors of the experts ahead, the routing traces they learn from, trace replay and the prompt sets."""

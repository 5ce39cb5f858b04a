"""Rewards: verifiers, reward models and the specs that combine them."""

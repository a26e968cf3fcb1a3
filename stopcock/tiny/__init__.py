"""Tiny real models built offline from configs: the demo models and the test fixtures.

Nothing here downloads anything. Weights are random unless a builder says otherwise.
"""

"""Sampling: the sampler, per-step sampling, grammar masks and the lossless verification of
draft tokens."""

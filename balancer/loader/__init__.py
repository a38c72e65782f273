"""Feeding a plan to training: the batch sampler, the collator, CP sharding and the attention
adapters. Plans and dataset rows in, tensors out."""

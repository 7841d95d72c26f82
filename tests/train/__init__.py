"""Tests of training: the dataset, sampler, balance, collator, loss, context parallelism, trainers."""

"""Requests, scheduling, sampling, the model runner and the engines built on them."""

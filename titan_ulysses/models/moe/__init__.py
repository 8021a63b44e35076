"""Mixture-of-experts feed-forward: a router, experts as grouped matrix products, the load-balancing loss."""

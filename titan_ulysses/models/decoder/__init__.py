"""The one decoder every family is (``models/families/``): ``args`` (what config.json sets), ``spec`` (what a family
changes beyond that), ``norm``, ``attention``, ``feed_forward`` (the seam a mixture of experts replaces), ``block``,
``model`` (nothing distributed) and ``parallelize`` (the fixed order of the parallelisms)."""

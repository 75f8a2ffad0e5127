"""A third party's edgepfl plugin: the encoder ``toy-cnn1d`` (:mod:`.encoder`) and the method
``smooth_per`` (:mod:`.method`), found by edgepfl through this package's entry points."""

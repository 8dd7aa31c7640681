"""The operator's commands: those that read a store or walk its namespaces and never mirror.
``status`` (:mod:`.status`) and ``history`` (:mod:`.history`) read one namespace; ``sessions``
(:mod:`.sessions`), ``prune`` (:mod:`.prune`) and ``verify`` (:mod:`.verify`) walk every namespace of
a store (:mod:`.namespaces`, grouped and judged by :mod:`.sessionplan`'s pure rules). ``prune``
deletes an ended namespace through :mod:`.pruner`; ``verify``'s rules are :mod:`.verifyplan`'s
(pure). None of the commands imports another.
"""

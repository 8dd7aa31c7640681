"""The restore: the latest state before the host starts (:mod:`.latest`) and ``restore --as-of``
(:mod:`.asof`). Its rules are :mod:`.plan`'s (pure); its sources (the objects, the roots'
bundles, the restore points) hand their files to one placer (:mod:`.place`), and one finish
(:mod:`.finish`) flushes the roots, records their lineage and removes their restore marker.
"""

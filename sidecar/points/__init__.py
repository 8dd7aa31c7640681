"""Restore points: their names and format, the header and the streamed encoder and verifying
reader (:mod:`.format`); the pure plans over them, which chain to restore, what retention deletes,
when a full point is due (:mod:`.plan`); and the daemon's writer of them (:mod:`.writer`). Reading
points for a restore is the restore's (:mod:`sidecar.restore.points`).
"""

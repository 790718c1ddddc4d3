"""Reading, checking and writing adapter artifacts: pure functions over local files, no Django models.

Everything here works on a local directory or file and raises `ArtifactError` with a
machine code and a sentence a person can act on. The Celery tasks in adapters.tasks
move bytes between the artifact store and a local work directory and call these.
"""

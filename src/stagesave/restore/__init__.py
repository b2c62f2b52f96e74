"""The path of a load: find checkpoints, check their proof, read them back safely (internal).

``discovery`` lists and chooses checkpoints, ``proof`` reads the proof inside a file,
``gc`` removes what crashed saves left behind. Loading itself is :meth:`stagesave.Checkpointer.load`.
"""

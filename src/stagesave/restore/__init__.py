"""The path of a load: find checkpoints, check their proof, read them back safely (internal).

In the order a load runs: ``discovery`` lists a directory (``info``: what it says of each
checkpoint and how they order; ``resolve_file``, ``resolve_folder``, ``plain``: how one file or
folder is judged), ``select`` chooses what a resume loads, ``proof`` reads the proof inside a
file, ``verify`` checks every byte against it (``verified_memo``: so a load does not hash it
twice), ``load`` opens one version and unpickles it through ``torch_load`` (the restricted
unpickler behind :mod:`stagesave.safety`: ``allowlist``, ``numpy_pickles``, ``unpickle``,
``refusal``). ``gc`` removes what crashed saves left behind (``debris`` finds it, ``liveness``
says whether its writer still runs). Loading itself is :meth:`stagesave.Checkpointer.load`.
"""

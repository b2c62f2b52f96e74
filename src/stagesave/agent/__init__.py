"""``writer="process"``: a writer agent that outlives the trainer (see ``docs/user-guide.md``).

:mod:`.client` is the trainer's side, :mod:`.serve` the agent (it imports no torch: keep this
package's ``__init__`` free of imports), :mod:`.wire` what they say to each other,
:mod:`.segments` the shared memory between them.
"""

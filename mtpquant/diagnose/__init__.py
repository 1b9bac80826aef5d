"""Is a checkpoint healthy, and how is it fixed: ``report`` gathers the facts into the ``InspectReport`` (``mtpquant
inspect``; every command that writes a checkpoint verifies its output with it), ``fixes`` the commands that repair
what it finds, ``verify`` the check an MTP write passes before it is put in place.
"""

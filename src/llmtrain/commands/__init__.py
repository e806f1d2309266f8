"""The commands of ``llmtrain <command>``: one module each, with its ``add_arguments(parser)`` and ``main(args)``.

A command module parses and checks its flags and calls the algorithm, which lives in its domain module
(``prepare`` and ``merge`` in :mod:`llmtrain.data.prep`, ``generate`` in :mod:`llmtrain.generate` and
:mod:`llmtrain.train.sample`, ``plan`` in :mod:`llmtrain.plan`, ``report`` in :mod:`llmtrain.report`, ...).
:mod:`llmtrain.cli` maps each command name to its module here and turns user errors into exit codes. A command
module imports its algorithm inside ``main``, so that ``llmtrain COMMAND --help`` stays fast. Nothing is
imported here.
"""

"""kvoff's command-line tools, apart from the library: ``kvoff replay`` (trace replay),
``kvoff bench`` (scheduler and transfer benchmarks), ``kvoff plan`` (sizing), ``kvoff info``
(build and runtime report), and the trace reader they share. ``kvoff.tools.cli.main`` is the
``kvoff`` console script."""

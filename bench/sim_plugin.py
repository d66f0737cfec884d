"""Imported by every process of a bench/async_sim.py run (`imports: [bench.sim_plugin]`): swaps in
the cost models of bench/sim_costs.py for the generation and training engines."""

from bench.sim_costs import install

install()

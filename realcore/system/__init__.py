"""The processes and their protocols: master, model workers, control and data planes, name resolution."""

"""What only moves bytes or names: the wire format, typed protocol messages, the control and data planes, the trajectory stream, name resolution, rendezvous. Imports realcore.api only."""

"""The jaxmem model zoo: Flax train steps used by tests, bench and users."""

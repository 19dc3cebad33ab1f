"""Support code the tests share: layouts, mocked parallel state, named stand-ins."""

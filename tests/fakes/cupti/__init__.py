"""A stand-in cupti-python package (test fixture): `cupti.cupti` is the fake."""

import pytest


@pytest.mark.msrun(worker_num=2)
class TestClass:
    def test_a(self, rank):
        assert rank in (0, 1)

    def test_b(self, world_size):
        assert world_size == 2

    @pytest.mark.msrun(worker_num=3)
    def test_override(self, world_size):
        assert world_size == 3

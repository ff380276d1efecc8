import pytest
from redis_server import RedisServer


@pytest.fixture
def redis_server(tmp_path):
    server = RedisServer(tmp_path).start()
    yield server
    server.kill()

"""Which services the server registers with gRPC by name, and that the others are still served, wrapped."""
from __future__ import annotations

import grpc
from grpc_health.v1 import health, health_pb2_grpc

from coda_client._proto import pacer_pb2_grpc
from coda_server.method_wrapping import WrappingRegistrar
from coda_server.server import SERVICE_NAME

HEALTH_SERVICE = "grpc.health.v1.Health"


class RecordingServer:
    """Stands in for a grpc.aio server: records what is registered, and how."""

    def __init__(self):
        self.by_name: dict[str, dict[str, grpc.RpcMethodHandler]] = {}
        self.generic: list[grpc.GenericRpcHandler] = []

    def add_registered_method_handlers(self, service, handlers):
        self.by_name[service] = handlers

    def add_generic_rpc_handlers(self, handlers):
        self.generic.extend(handlers)


class Marking:
    """A wrapper that records the methods it wrapped and returns a handler it can recognise."""

    def __init__(self):
        self.wrapped: dict[str, grpc.RpcMethodHandler] = {}

    def wrap(self, method, handler):
        marked = grpc.unary_unary_rpc_method_handler(handler.unary_unary or (lambda request, context: None))
        self.wrapped[method] = marked
        return marked


class Details(grpc.HandlerCallDetails):
    def __init__(self, method):
        self.method, self.invocation_metadata = method, ()


def registered(by_name):
    server, marking = RecordingServer(), Marking()
    registrar = WrappingRegistrar(server, [marking], by_name=by_name)
    pacer_pb2_grpc.add_RolloutPacerServicer_to_server(pacer_pb2_grpc.RolloutPacerServicer(), registrar)
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), registrar)
    return server, marking


def served(server, method):
    for generic in server.generic:
        handler = generic.service(Details(method))
        if handler is not None:
            return handler
    return None


def test_only_the_pacer_is_registered_by_name_and_health_is_served_generically_still_wrapped():
    server, marking = registered([SERVICE_NAME])
    assert list(server.by_name) == [SERVICE_NAME]
    assert server.by_name[SERVICE_NAME]["Dispatch"] is marking.wrapped[f"/{SERVICE_NAME}/Dispatch"]
    for method in ("Check", "Watch"):
        handler = served(server, f"/{HEALTH_SERVICE}/{method}")
        assert handler is not None and handler is marking.wrapped[f"/{HEALTH_SERVICE}/{method}"]


def test_without_a_list_every_service_is_registered_by_name():
    server, _ = registered(None)
    assert set(server.by_name) == {SERVICE_NAME, HEALTH_SERVICE}

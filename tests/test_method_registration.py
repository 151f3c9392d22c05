"""Which services the server registers with gRPC by name, and that the others are still served, wrapped."""
from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

import coda_server.server as server_module
from coda_client._proto import pacer_pb2 as pb, pacer_pb2_grpc
from coda_server.core import load_config
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


def test_no_service_is_registered_by_name_and_each_method_is_served_generically_wrapped():
    server, marking = registered(())
    assert server.by_name == {}
    for service, method in ((SERVICE_NAME, "Dispatch"), (SERVICE_NAME, "GetState"), (HEALTH_SERVICE, "Check"),
                            (HEALTH_SERVICE, "Watch")):
        handler = served(server, f"/{service}/{method}")
        assert handler is not None and handler is marking.wrapped[f"/{service}/{method}"]
    assert served(server, f"/{SERVICE_NAME}/NoSuchMethod") is None


def test_only_the_services_named_are_registered_by_name():
    server, marking = registered([SERVICE_NAME])
    assert list(server.by_name) == [SERVICE_NAME]
    assert server.by_name[SERVICE_NAME]["Dispatch"] is marking.wrapped[f"/{SERVICE_NAME}/Dispatch"]
    handler = served(server, f"/{HEALTH_SERVICE}/Check")
    assert handler is not None and handler is marking.wrapped[f"/{HEALTH_SERVICE}/Check"]


def test_without_a_list_every_service_is_registered_by_name():
    server, _ = registered(None)
    assert set(server.by_name) == {SERVICE_NAME, HEALTH_SERVICE}


def test_the_server_registers_no_method_by_name_and_answers_through_its_generic_handlers(monkeypatch):
    by_name = []
    make_server = grpc.aio.server

    def recording_server(*args, **kwargs):
        server = make_server(*args, **kwargs)
        register = server.add_registered_method_handlers

        def add_registered_method_handlers(service, handlers):
            by_name.append(service)
            register(service, handlers)

        server.add_registered_method_handlers = add_registered_method_handlers
        return server

    monkeypatch.setattr(server_module.grpc.aio, "server", recording_server)
    config = load_config(overrides=["server.address=127.0.0.1:0", "server.metrics_address=", "server.state_dir="])

    async def serve_one_call():
        server = server_module.PacerServer(config)
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.listeners.tcp_port}") as channel:
                state = await pacer_pb2_grpc.RolloutPacerStub(channel).GetState(pb.GetStateRequest(), timeout=30)
                health_answer = await health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service="readiness"), timeout=30)
        finally:
            await server.stop(0)
        return state, health_answer

    state, health_answer = asyncio.run(serve_one_call())
    assert by_name == []
    assert state.strategy and health_answer.status == health_pb2.HealthCheckResponse.SERVING

"""Try py-libp2p 0.8.1 circuit relay v2 + DCUtR between two homes behind MASQUERADE (bench/netns.py)."""
import threading, traceback
import multiaddr, trio
from echo2.bench.netns import Net
from echo2.protocol.identity import Identity
from echo2.protocol.net.libp2p_host import build_host, keypair_from_identity
from libp2p.peer.peerinfo import info_from_p2p_addr
from libp2p.relay.circuit_v2.protocol import CircuitV2Protocol, PROTOCOL_ID as HOP
from libp2p.relay.circuit_v2.transport import CircuitV2Transport
from libp2p.relay.circuit_v2.config import RelayConfig
from libp2p.relay.circuit_v2.dcutr import DCUtRProtocol
from libp2p.tools.anyio_service.context import background_trio_service

out = {}; ev = {k: threading.Event() for k in ("hub", "b", "done")}; addr = {}

def host_for(ip):
    return build_host(keypair_from_identity(Identity.generate()), multiaddr.Multiaddr(f"/ip4/{ip}/tcp/4001"),
                      max_connections=64, dial_timeout_s=5)

def run_in(net, i, fn):
    with net.inside(i):
        try:
            trio.run(fn)
        except BaseException as e:
            out[f"h{i}-crash"] = "".join(traceback.format_exception(e))[-900:]
        finally:
            ev["b"].set(); ev["hub"].set()

def hub(net):
    async def main():
        h = host_for(net.ip(0))
        async with h.run([multiaddr.Multiaddr(f"/ip4/{net.ip(0)}/tcp/4001")]):
            proto = CircuitV2Protocol(h, allow_hop=True)
            async with background_trio_service(proto):
                addr["hub"] = f"/ip4/{net.ip(0)}/tcp/4001/p2p/{h.get_id()}"
                ev["hub"].set()
                while not ev["done"].is_set():
                    await trio.sleep(0.2)
    run_in(net, 0, main)

def client(net, i, role):
    async def main():
        h = host_for(net.ip(i))
        async with h.run([multiaddr.Multiaddr(f"/ip4/{net.ip(i)}/tcp/4001")]):
            proto = CircuitV2Protocol(h, allow_hop=False)
            dcutr = DCUtRProtocol(h)
            async with background_trio_service(proto), background_trio_service(dcutr), trio.open_nursery() as nursery:
                transport = CircuitV2Transport(h, proto, RelayConfig())
                hub_info = info_from_p2p_addr(multiaddr.Multiaddr(addr["hub"]))
                with trio.fail_after(60):
                    await h.connect(hub_info)
                    if role == "b":
                        s = await h.new_stream(hub_info.peer_id, [HOP])
                        out["b-reserve"] = await transport.reserve(s, hub_info.peer_id, nursery)
                        addr["b"] = str(h.get_id())
                        ev["b"].set()
                        await trio.to_thread.run_sync(ev["done"].wait, 40)
                    else:
                        await trio.to_thread.run_sync(ev["b"].wait, 30)
                        ma = multiaddr.Multiaddr(addr["hub"] + "/p2p-circuit/p2p/" + addr["b"])
                        try:
                            conn = await transport.dial(ma)
                            out["a-relayed-dial"] = str(conn)
                        except BaseException as e:
                            out["a-relayed-dial-error"] = repr(e)[:400]
                        from libp2p.peer.id import ID
                        try:
                            ok = await dcutr.initiate_hole_punch(ID.from_base58(addr["b"]))
                            out["a-hole-punch"] = ok
                        except BaseException as e:
                            out["a-hole-punch-error"] = repr(e)[:400]
                        conns = h.get_network().get_connections(ID.from_base58(addr["b"])) if hasattr(h.get_network(), "get_connections") else []
                        from echo2.protocol.net.libp2p_host import remote_ip_of
                        out["a-conns-to-b"] = [(type(getattr(c, "muxed_conn", c)).__name__, remote_ip_of(getattr(c, "muxed_conn", c)), [str(a) for a in (c.get_transport_addresses() if hasattr(c, "get_transport_addresses") else [])]) for c in conns][:4]
                        ev["done"].set()
                nursery.cancel_scope.cancel()
    run_in(net, i, main)

with Net(4, 8, nat={2, 3}) as net:
    t0 = threading.Thread(target=hub, args=(net,), daemon=True); t0.start(); ev["hub"].wait(20)
    tb = threading.Thread(target=client, args=(net, 3, "b"), daemon=True); tb.start()
    ta = threading.Thread(target=client, args=(net, 2, "a"), daemon=True); ta.start()
    ta.join(90); ev["done"].set(); tb.join(20); t0.join(10)
for k, v in out.items():
    print(k, "=>", v)

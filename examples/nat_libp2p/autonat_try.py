"""Try py-libp2p 0.8.1's AutoNAT across a MASQUERADE home (bench/netns.py nat=)."""
import threading, traceback
import multiaddr, trio
from echo2.bench.netns import Net
from echo2.protocol.identity import Identity
from echo2.protocol.net.libp2p_host import build_host, keypair_from_identity
from libp2p.host.autonat.autonat import AutoNATService
from libp2p.peer.peerinfo import info_from_p2p_addr

out = {}
hub_ready = threading.Event(); done = threading.Event(); hub_addr = {}

def host_for(ip, port):
    return build_host(keypair_from_identity(Identity.generate()), multiaddr.Multiaddr(f"/ip4/{ip}/tcp/{port}"),
                      max_connections=64, dial_timeout_s=5)

def hub(net):
    async def main():
        h = host_for(net.ip(0), 4001)
        async with h.run([multiaddr.Multiaddr(f"/ip4/{net.ip(0)}/tcp/4001")]):
            AutoNATService(h, serve=True)
            hub_addr["a"] = f"/ip4/{net.ip(0)}/tcp/4001/p2p/{h.get_id()}"
            hub_ready.set()
            while not done.is_set():
                await trio.sleep(0.2)
    with net.inside(0):
        trio.run(main)

def client(net, i):
    async def main():
        h = host_for(net.ip(i), 4001)
        async with h.run([multiaddr.Multiaddr(f"/ip4/{net.ip(i)}/tcp/4001")]):
            svc = AutoNATService(h, serve=False, confirmations=1)
            info = info_from_p2p_addr(multiaddr.Multiaddr(hub_addr["a"]))
            with trio.fail_after(30):
                await h.connect(info)
                try:
                    st, addr = await svc.query_server(info.peer_id, timeout=20)
                    out[i] = ("status", st, multiaddr.Multiaddr(addr) if addr else None)
                except Exception as e:
                    out[i] = ("error", repr(e))
            svc2 = AutoNATService(h, serve=False)  # default: 4 confirmations
            svc2.dial_results = dict(svc.dial_results); svc2.update_status()
            out[f"{i}-default-confirmations"] = svc2.get_status()
    with net.inside(i):
        try:
            trio.run(main)
        except BaseException as e:
            out[i] = ("crash", "".join(traceback.format_exception(e))[-600:])

with Net(3, 8, nat={2}) as net:
    t = threading.Thread(target=hub, args=(net,), daemon=True); t.start()
    hub_ready.wait(20)
    for i in (1, 2):
        c = threading.Thread(target=client, args=(net, i)); c.start(); c.join(60)
    done.set(); t.join(10)
from libp2p.host.autonat.pb.autonat_pb2 import Message
print("statuses:", {v: k for k, v in Message.ResponseStatus.items()})
for k, v in out.items():
    print(k, v)

// Another libp2p implementation (js-libp2p) against a running echo2 hub (issue 20):
// dial it over TCP + Noise + Yamux, read its identify record, ping it, and hear node
// announcements on the hub's GossipSub topic. Prints one JSON line; exit 0 only if all four held.
//   node interop.mjs <hub multiaddr> [seconds]
import './polyfill.mjs'
import { createLibp2p } from 'libp2p'
import { tcp } from '@libp2p/tcp'
import { noise } from '@chainsafe/libp2p-noise'
import { yamux } from '@chainsafe/libp2p-yamux'
import { identify } from '@libp2p/identify'
import { ping } from '@libp2p/ping'
import { gossipsub } from '@libp2p/gossipsub'
import { multiaddr } from '@multiformats/multiaddr'

const TOPIC = 'echo2/announce/1'
const addr = multiaddr(process.argv[2])
const seconds = Number(process.argv[3] ?? 40)
const out = { dialled: false, identify: null, ping_ms: null, announcements: 0, announcers: [] }

const node = await createLibp2p({
  addresses: { listen: ['/ip4/127.0.0.1/tcp/0'] },
  transports: [tcp()],
  connectionEncrypters: [noise()],
  streamMuxers: [yamux()],
  services: {
    identify: identify(),
    ping: ping(),
    pubsub: gossipsub({ allowPublishToZeroTopicPeers: true, emitSelf: false })
  }
})
let identified = null
node.addEventListener('peer:identify', (ev) => {
  if (ev.detail.peerId.toString() === addr.getComponents().find((c) => c.name === 'p2p')?.value) identified = ev.detail
})
const seen = new Set()
node.services.pubsub.addEventListener('message', (ev) => {
  if (ev.detail.topic !== TOPIC) return
  out.announcements += 1
  const from = ev.detail.from ? ev.detail.from.toString() : '?'
  seen.add(from)
})
node.services.pubsub.subscribe(TOPIC)
const deadline = Date.now() + seconds * 1000
try {
  const conn = await node.dial(addr, { signal: AbortSignal.timeout(15000) })
  out.dialled = true
  // js-libp2p identifies every new connection by itself (a second identify stream is refused)
  const idDeadline = Date.now() + 10000
  while (identified === null && Date.now() < idDeadline) await new Promise((r) => setTimeout(r, 50))
  const id = identified ?? await node.services.identify.identify(conn, { signal: AbortSignal.timeout(10000) })
  out.identify = { agent: id.agentVersion, protocol: id.protocolVersion, protocols: id.protocols }
  out.ping_ms = await node.services.ping.ping(addr, { signal: AbortSignal.timeout(10000) })
  while (Date.now() < deadline && out.announcements < 1) {
    await new Promise((r) => setTimeout(r, 250))
  }
} catch (e) {
  out.error = String(e && e.stack ? e.stack : e).slice(0, 2000)
}
out.announcers = [...seen]
console.log(JSON.stringify(out))
await node.stop()
process.exit(out.dialled && out.identify && out.ping_ms !== null && out.announcements > 0 ? 0 : 1)

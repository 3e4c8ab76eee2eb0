// Node 20 (Debian's) lacks Promise.withResolvers, which js-libp2p 3 uses (Node >= 22 has it).
if (typeof Promise.withResolvers !== 'function') {
  Promise.withResolvers = function () {
    let resolve, reject
    const promise = new Promise((res, rej) => { resolve = res; reject = rej })
    return { promise, resolve, reject }
  }
}

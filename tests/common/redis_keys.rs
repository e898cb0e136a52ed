//! Plain Redis helpers for the state tests: a connection and deleting a namespace's keys.
#![allow(dead_code)]

pub async fn conn(url: &str) -> redis::aio::MultiplexedConnection {
    redis::Client::open(url)
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap()
}

/// Deletes every key starting with `prefix` (a test's namespace hash tag).
pub async fn delete_prefix(url: &str, prefix: &str) {
    let mut c = conn(url).await;
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{prefix}*"))
        .query_async(&mut c)
        .await
        .unwrap();
    if !keys.is_empty() {
        let _: () = redis::cmd("DEL")
            .arg(keys)
            .query_async(&mut c)
            .await
            .unwrap();
    }
}

//! docker-compose.yml cannot run here (no image registry), so its shape is
//! checked instead: every service docs/operations.md names is there with a
//! healthcheck, dependencies wait for health, the service's HTTP port is
//! published, and `target/` stays out of the build context.

use std::collections::BTreeSet;

use serde_yaml::Value;

fn root(path: &str) -> String {
    std::fs::read_to_string(format!("{}/{path}", env!("CARGO_MANIFEST_DIR")))
        .unwrap_or_else(|e| panic!("reading {path}: {e}"))
}

/// The service names in docs/operations.md's "Docker Compose" section: the
/// backticked words of its `Services:` sentence, when
/// a word is a bare name (not a command).
fn readme_services() -> BTreeSet<String> {
    let readme = root("docs/operations.md");
    let section = readme
        .split("\n## ")
        .find(|s| s.starts_with("Docker Compose"))
        .expect("docs/operations.md has a `## Docker Compose` section");
    let start = section
        .find("\nServices:")
        .expect("the Docker Compose section has a `Services:` sentence");
    let sentence = section[start..].split(".\n").next().unwrap();
    sentence
        .split('`')
        .skip(1)
        .step_by(2)
        .filter(|w| !w.contains(' ') && !w.contains(':'))
        .map(str::to_string)
        .collect()
}

#[test]
fn compose_runs_every_service_the_readme_names_with_healthchecks() {
    let compose: Value = serde_yaml::from_str(&root("docker-compose.yml")).unwrap();
    let services = compose["services"]
        .as_mapping()
        .expect("docker-compose.yml has services");
    let names: BTreeSet<String> = services
        .keys()
        .map(|k| k.as_str().unwrap().to_string())
        .collect();
    let named = readme_services();
    assert!(
        named.len() >= 5,
        "the README names the compose services: {named:?}"
    );
    for service in ["postgres", "kafka", "rabbitmq", "almanac", "worker"] {
        assert!(named.contains(service), "README lacks {service}");
    }
    let missing: Vec<_> = named.difference(&names).collect();
    assert!(
        missing.is_empty(),
        "README names services compose lacks: {missing:?}"
    );

    for (name, service) in services {
        let name = name.as_str().unwrap();
        let check = &service["healthcheck"]["test"];
        assert!(
            check.is_sequence() || check.is_string(),
            "service {name} has no healthcheck"
        );
        if let Some(deps) = service["depends_on"].as_mapping() {
            for (dep, how) in deps {
                assert_eq!(
                    how["condition"].as_str(),
                    Some("service_healthy"),
                    "{name} must wait for {dep:?} to be healthy"
                );
                assert!(names.contains(dep.as_str().unwrap()));
            }
        }
    }

    let almanac = &services["almanac"];
    let command: Vec<&str> = almanac["command"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    assert_eq!(command, ["almanac", "run"]);
    let ports: Vec<&str> = almanac["ports"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    assert!(
        ports.iter().any(|p| p.ends_with(":9797")),
        "the HTTP port is published: {ports:?}"
    );
    let env = &almanac["environment"];
    assert!(
        env["ALMANAC_HTTP_BASIC_AUTH"].is_string(),
        "listening beyond loopback needs basic auth"
    );
    for dep in ["postgres", "kafka", "rabbitmq"] {
        assert!(
            almanac["depends_on"][dep].is_mapping(),
            "almanac waits for {dep}"
        );
    }

    let worker = services["worker"]["command"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap().to_string())
        .collect::<Vec<_>>()
        .join(" ");
    assert!(worker.starts_with("almanac work"));
    let schedules = root("schedules/examples.toml");
    for kind in schedules
        .lines()
        .filter_map(|l| l.strip_prefix("kind = \""))
        .map(|l| l.trim_end_matches('"'))
    {
        assert!(
            worker.contains(&format!("{kind}=")),
            "the worker has a handler for the example kind {kind}"
        );
    }

    let ignore = root(".dockerignore");
    assert!(ignore
        .lines()
        .any(|l| l.trim().trim_end_matches('/') == "target"));
}

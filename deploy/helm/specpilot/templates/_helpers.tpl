{{- define "specpilot.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "specpilot.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "specpilot.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "specpilot.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- .Values.serviceAccount.name | default (include "specpilot.fullname" .) -}}
{{- else -}}
{{- .Values.serviceAccount.name | default "default" -}}
{{- end -}}
{{- end -}}

{{/* engine.resources with engine.gpu's count of its resource in requests and limits (an
extended resource's request must equal its limit). */}}
{{- define "specpilot.engineResources" -}}
{{- $resources := deepCopy .Values.engine.resources -}}
{{- $gpu := .Values.engine.gpu -}}
{{- if gt (int $gpu.count) 0 -}}
{{- range $kind := list "requests" "limits" -}}
{{- $_ := set $resources $kind (set (get $resources $kind | default dict) $gpu.resource (int $gpu.count)) -}}
{{- end -}}
{{- end -}}
{{- toYaml $resources -}}
{{- end -}}

{{- define "specpilot.tokenSecret" -}}
{{- .Values.policyToken.existingSecret | default (printf "%s-token" (include "specpilot.fullname" .)) -}}
{{- end -}}

{{/* The name TLS clients check the controller's certificate for (tls.serverName). */}}
{{- define "specpilot.tlsServerName" -}}
{{- .Values.tls.serverName | default (printf "%s.%s.svc" (include "specpilot.fullname" .) .Release.Namespace) -}}
{{- end -}}

{{/* Where the engine connects: the mTLS engine port with tls.engineClientAuth, else gRPC. */}}
{{- define "specpilot.engineTarget" -}}
{{- if and .Values.tls.enabled .Values.tls.engineClientAuth -}}
127.0.0.1:{{ .Values.tls.engineGrpcPort }}
{{- else -}}
127.0.0.1:{{ .Values.controller.grpcPort }}
{{- end -}}
{{- end -}}

{{/* The checks no schema can express; each names the value to change. */}}
{{- define "specpilot.checks" -}}
{{- if and .Values.sidecar.native (not (semverCompare ">=1.29.0-0" .Capabilities.KubeVersion.Version)) -}}
{{- fail (printf "sidecar.native=true needs Kubernetes >= 1.29 (native sidecars); this cluster is %s: set sidecar.native=false" .Capabilities.KubeVersion.Version) -}}
{{- end -}}
{{- if and .Values.redis.enabled (not (or .Values.redis.url .Values.redis.existingSecret)) -}}
{{- fail "redis.enabled=true needs redis.url or redis.existingSecret" -}}
{{- end -}}
{{- if and .Values.tls.enabled (not .Values.tls.secretName) -}}
{{- fail "tls.enabled=true needs tls.secretName: a kubernetes.io/tls Secret with tls.crt, tls.key and the CA under tls.caKey" -}}
{{- end -}}
{{- if and .Values.tls.engineClientAuth (not .Values.tls.enabled) -}}
{{- fail "tls.engineClientAuth=true needs tls.enabled=true (client certificates are asked for over TLS)" -}}
{{- end -}}
{{- if and .Values.tls.enabled .Values.tls.engineClientAuth (has (int .Values.tls.engineGrpcPort) (list (int .Values.controller.grpcPort) (int .Values.controller.httpPort))) -}}
{{- fail "tls.engineGrpcPort must differ from controller.grpcPort and controller.httpPort" -}}
{{- end -}}
{{- with .Values.engine.speculativeConfig -}}
{{- if and (kindIs "string" .) (hasKey (fromJson .) "Error") -}}
{{- fail (printf "engine.speculativeConfig is not a JSON object: %s" .) -}}
{{- end -}}
{{- end -}}
{{- if eq .Values.model.source "volume" -}}
{{- $v := .Values.model.volume -}}
{{- $given := 0 -}}
{{- range (list $v.existingClaim $v.hostPath $v.spec) }}{{ if . }}{{ $given = add1 $given }}{{ end }}{{ end -}}
{{- if ne (int $given) 1 -}}
{{- fail "model.source=volume needs exactly one of model.volume.existingClaim, model.volume.hostPath and model.volume.spec" -}}
{{- end -}}
{{- end -}}
{{- range .Values.engine.extraArgs -}}
{{- if or (hasPrefix "--async-scheduling" .) (hasPrefix "--no-async-scheduling" .) (hasPrefix "--scheduler-cls" .) -}}
{{- fail (printf "engine.extraArgs has %s: set engine.asyncScheduling instead (the chart passes the async-scheduling flag and the matching specpilot scheduler class)" .) -}}
{{- end -}}
{{- end -}}
{{- if and .Values.metrics.serviceMonitor.enabled .Values.metrics.podMonitor.enabled -}}
{{- fail "metrics.serviceMonitor.enabled and metrics.podMonitor.enabled are both true: enable one (each would scrape the controller)" -}}
{{- end -}}
{{- end -}}

{{/* The engine secret, for the controller (which checks engines' tokens) and the init
container that derives the engine's own token; never for the engine. */}}
{{- define "specpilot.engineSecretEnv" -}}
- name: SPECPILOT_ENGINE_SECRET
  valueFrom:
    secretKeyRef:
      name: {{ include "specpilot.tokenSecret" . }}
      key: {{ .Values.policyToken.engineSecretKey }}
{{- end -}}

{{/* Where the engine reads its own token (the engine-token emptyDir). */}}
{{- define "specpilot.engineTokenDir" -}}
/run/specpilot-engine
{{- end -}}

{{/* An init container that writes the engine's own token (derived from the engine secret and
its engine id, the pod's name) for the engine to read; it runs before the engine (and before a
native sidecar), and is the only container besides the controller that sees the secret. It runs
the engine's image, which holds specpilot (the plugin's wheel, its CLI included), so the engine's
start never needs the controller's image (fail-static includes the Pod: an unpullable controller
image leaves the engine serving on its static configuration). The module form runs the CLI with
the interpreter the plugin is installed in (the image's entry point is vLLM's server).
NVIDIA_VISIBLE_DEVICES=void: the vLLM image's CUDA base sets "all", which would show every GPU of
the node to a container that requests none. */}}
{{- define "specpilot.engineTokenContainer" -}}
- name: engine-token
  image: "{{ .Values.engine.image.repository }}:{{ .Values.engine.image.tag }}"
  imagePullPolicy: {{ .Values.engine.image.pullPolicy }}
  command: ["python3", "-m", "specpilot.controller.cli"]
  args: ["engine-token", "--id", "$(POD_NAME)", "--output", "{{ include "specpilot.engineTokenDir" . }}/token"]
  env:
    - name: POD_NAME
      valueFrom:
        fieldRef:
          fieldPath: metadata.name
    {{- include "specpilot.engineSecretEnv" . | nindent 4 }}
    - name: NVIDIA_VISIBLE_DEVICES
      value: void
  resources:
    {{- toYaml .Values.engine.tokenInit.resources | nindent 4 }}
  securityContext:
    {{- toYaml (merge (dict "readOnlyRootFilesystem" true) (deepCopy (.Values.engine.securityContext | default dict))) | nindent 4 }}
  volumeMounts:
    - name: engine-token
      mountPath: {{ include "specpilot.engineTokenDir" . }}
{{- end -}}

{{/* The name vLLM serves the model under, as its hello and its metrics name it: the first
--served-model-name of engine.extraArgs, else engine.model. */}}
{{- define "specpilot.servedModel" -}}
{{- $served := "" -}}
{{- $args := .Values.engine.extraArgs -}}
{{- range $i, $a := $args -}}
{{- if not $served -}}
{{- if hasPrefix "--served-model-name=" $a -}}
{{- $served = first (splitList " " (trimPrefix "--served-model-name=" $a)) -}}
{{- else if and (eq $a "--served-model-name") (lt (add1 $i) (len $args)) -}}
{{- $served = index $args (add1 $i) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- $served | default .Values.engine.model -}}
{{- end -}}

{{- define "specpilot.controllerContainer" -}}
- name: specpilot
  image: "{{ .Values.controller.image.repository }}:{{ .Values.controller.image.tag }}"
  imagePullPolicy: {{ .Values.controller.image.pullPolicy }}
  {{- if .Values.sidecar.native }}
  restartPolicy: Always
  {{- end }}
  args: ["serve", "--config", "/etc/specpilot/specpilot.yaml", "--log-level", {{ .Values.controller.logLevel | quote }}]
  env:
    - name: SPECPILOT_POLICY_TOKEN
      valueFrom:
        secretKeyRef:
          name: {{ include "specpilot.tokenSecret" . }}
          key: {{ .Values.policyToken.key }}
    {{- include "specpilot.engineSecretEnv" . | nindent 4 }}
    - name: SPECPILOT_DASHBOARD_READ_TOKEN
      valueFrom:
        secretKeyRef:
          name: {{ include "specpilot.tokenSecret" . }}
          key: {{ .Values.policyToken.readKey }}
    - name: SPECPILOT_SIDECAR_ID
      valueFrom:
        fieldRef:
          fieldPath: metadata.name
    {{- if .Values.redis.enabled }}
    - name: SPECPILOT_STATE_STORE
      {{- if .Values.redis.existingSecret }}
      valueFrom:
        secretKeyRef:
          name: {{ .Values.redis.existingSecret }}
          key: {{ .Values.redis.existingSecretKey }}
      {{- else }}
      value: {{ .Values.redis.url | quote }}
      {{- end }}
    {{- end }}
    {{- with .Values.controller.env }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  ports:
    - name: grpc
      containerPort: {{ .Values.controller.grpcPort }}
    - name: http-metrics
      containerPort: {{ .Values.controller.httpPort }}
    {{- if and .Values.tls.enabled .Values.tls.engineClientAuth }}
    - name: grpc-engine
      containerPort: {{ .Values.tls.engineGrpcPort }}
    {{- end }}
  {{- /* A liveness probe only: the kubelet restarts a stuck controller, while its health never
  decides the pod's readiness (a sidecar's readiness and startup probes count toward the pod's
  and would hold back the engine's start); the engine serves on without it (fail-static).
  The kubelet's gRPC probes cannot speak TLS (before Kubernetes 1.37's alpha): with TLS, the
  probe is an HTTPS GET of /healthz (the kubelet skips certificate verification), which the same
  process answers; no exec, so no Python process per probe in the container's memory. */}}
  livenessProbe:
    {{- if .Values.tls.enabled }}
    httpGet: {path: /healthz, port: http-metrics, scheme: HTTPS}
    {{- else }}
    grpc: {port: {{ .Values.controller.grpcPort }}}
    {{- end }}
    initialDelaySeconds: 10
    periodSeconds: 10
    failureThreshold: 3
  resources:
    {{- toYaml .Values.controller.resources | nindent 4 }}
  {{- with .Values.controller.securityContext }}
  securityContext:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  volumeMounts:
    - name: specpilot-config
      mountPath: /etc/specpilot
      readOnly: true
    {{- if .Values.tls.enabled }}
    - name: specpilot-tls
      mountPath: /etc/specpilot-tls
      readOnly: true
    {{- end }}
    {{- with .Values.controller.volumeMounts }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
{{- end -}}
